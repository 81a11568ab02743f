"""The container check: the CPU image built and compose run for real, with podman
(``scripts/container-check``; not in ``./scripts/test``'s paths, see that script)."""
