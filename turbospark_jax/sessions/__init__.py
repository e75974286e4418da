"""Multi-turn use: the session pool and chat sessions over it."""
