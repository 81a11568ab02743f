"""Servers as the tests and the benchmarks run them: our server and vLLM's in fresh
processes, PostgreSQL and HAProxy on loopback. The benchmarks import it from here."""
