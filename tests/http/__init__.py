"""The edge: error shapes, limits, fuzzing of every route and websocket."""
