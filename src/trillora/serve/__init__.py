"""Servers over a resident model: the Tinker-compatible training service (`serve --tinker`)."""
