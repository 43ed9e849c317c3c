"""Test and demo tools: tiny models and toy datasets built locally (no network), and fault injection for the guard."""
