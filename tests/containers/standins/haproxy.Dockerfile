# Stand-in for haproxy:2.6 (no registry is reachable here): Debian bookworm's HAProxy 2.6,
# reading the configuration where the official image does.
ARG BASE_IMAGE
FROM ${BASE_IMAGE}
RUN apt-get update && apt-get install -y --no-install-recommends haproxy \
    && rm -rf /var/lib/apt/lists/*
CMD ["haproxy", "-W", "-db", "-f", "/usr/local/etc/haproxy/haproxy.cfg"]
