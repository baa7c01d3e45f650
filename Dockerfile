# idemproxy container image. Build: docker build -t idemproxy .
# Runs as an unprivileged user; the CA comes from a mounted volume (never baked in), the
# embedded store (if used) from another. See docker-compose.yml and README.md ("Deployment").
# The base images are arguments so that a machine without a registry can build it from images
# made locally (scripts/build-image.sh: debootstrap + buildah, what the test suite runs).
ARG RUST_IMAGE=rust:1.89-bookworm
ARG BASE_IMAGE=debian:bookworm-slim

FROM ${RUST_IMAGE} AS build
WORKDIR /src
COPY Cargo.toml Cargo.lock ./
COPY src ./src
RUN cargo build --release --locked --bin idemproxy

FROM ${BASE_IMAGE}
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 10001 idemproxy \
 && useradd --system --uid 10001 --gid idemproxy --home-dir /var/lib/idemproxy --shell /usr/sbin/nologin idemproxy \
 && mkdir -p /var/lib/idemproxy/data /etc/idemproxy/certs \
 && chown -R idemproxy:idemproxy /var/lib/idemproxy /etc/idemproxy/certs
COPY --from=build /src/target/release/idemproxy /usr/local/bin/idemproxy
COPY config/docker.toml /etc/idemproxy/idemproxy.toml
USER 10001:10001
WORKDIR /var/lib/idemproxy
# certs: ca.pem + ca.key made by `idemproxy ca init`; data: the embedded store, if used.
VOLUME ["/etc/idemproxy/certs", "/var/lib/idemproxy/data"]
# 8080 proxy, 9090 admin (health, metrics, key API: do not publish it beyond the host).
EXPOSE 8080 9090
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
  CMD ["idemproxy", "healthcheck", "--url", "http://127.0.0.1:9090/healthz"]
ENTRYPOINT ["idemproxy"]
CMD ["serve", "--config", "/etc/idemproxy/idemproxy.toml"]
