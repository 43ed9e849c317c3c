"""Test and demo tools: tiny models and toy datasets built locally (no network), fault injection for the guard, and
one trainer builder with quick run settings (used by the tests, the demo and the bench)."""
