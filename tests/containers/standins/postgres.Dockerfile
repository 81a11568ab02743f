# Stand-in for postgres:16-alpine (no registry is reachable here): Debian's PostgreSQL,
# with the interface compose.yaml uses: POSTGRES_USER/PASSWORD/DB, the data directory
# /var/lib/postgresql/data, port 5432, pg_isready.
ARG BASE_IMAGE
FROM ${BASE_IMAGE}
RUN mkdir -p /etc/postgresql-common \
    && echo "create_main_cluster = false" > /etc/postgresql-common/createcluster.conf \
    && apt-get update && apt-get install -y --no-install-recommends postgresql-15 \
    && rm -rf /var/lib/apt/lists/*
ENV PATH=/usr/lib/postgresql/15/bin:$PATH \
    PGDATA=/var/lib/postgresql/data
COPY postgres-entrypoint.sh /usr/local/bin/
EXPOSE 5432
ENTRYPOINT ["sh", "/usr/local/bin/postgres-entrypoint.sh"]
