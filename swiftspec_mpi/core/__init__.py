"""Shared by every layer: run config, errors, rank topology, MPI communication."""
