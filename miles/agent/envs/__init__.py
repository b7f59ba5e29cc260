"""Example environments for the plug-in layers (docs/agentic.md)."""
