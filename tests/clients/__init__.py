"""Shared pieces of the third-party client tests (tests/test_clients_*.py)."""
