"""Speculative decoding (`--speculative-config`): drafts proposed on the host, verified by the target in
one step shaped like a decode step (docs/speculative.md)."""
