"""The Tinker-compatible face: its REST routes, wire format, checks, saved states and the
service that runs its training clients on the resident base."""
