"""Our APIs over real HTTP and websockets, one folder each."""
