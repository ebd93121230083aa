"""Host-side scheduling: Python and numpy only, never jax."""
