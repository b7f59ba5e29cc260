"""Small built-in tasks used by the demo and the end-to-end tests."""
