"""Request and result types and the generation driver that turns a producer into completions."""
