"""Helpers every process may import (no process imports another process's package)."""
