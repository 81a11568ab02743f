"""The container's health probe: ``python -m app.http.healthcheck [path]`` exits 0 when
this server answers ``/health`` (or ``path``) with 200, on ``STREAMSESS_PORT``.

A module of the standard library only (it starts in a fraction of a second, where
importing the app takes seconds), run with no argument that holds a space: podman's
Docker-compatible API splits a compose healthcheck's ``CMD`` arguments on spaces, so
``python -c "import urllib.request; ..."`` reached the container as broken Python."""

from __future__ import annotations

import os
import sys
import urllib.request


def main(argv: list[str]) -> int:
    path = argv[0] if argv else "/health"
    url = f"http://127.0.0.1:{os.environ.get('STREAMSESS_PORT', '8000')}{path}"
    try:
        with urllib.request.urlopen(url, timeout=4) as answer:
            return 0 if answer.status == 200 else 1
    except OSError as exc:
        print(f"{url}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
