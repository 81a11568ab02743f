"""Our APIs, one package each: what a client calls."""
