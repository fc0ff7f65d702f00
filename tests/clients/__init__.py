"""Shared pieces of the third-party client tests (tests/e2e/test_clients_realtime.py)."""
