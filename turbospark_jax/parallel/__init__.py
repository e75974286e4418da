"""Meshes, tensor-parallel sharding, data-parallel replicas and multi-host start-up."""
