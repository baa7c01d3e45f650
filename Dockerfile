# Minimal image; the full deployment set-up (non-root user, CA volume, health check) is
# tracked in the operations issue.
FROM rust:1.89-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked

FROM debian:bookworm-slim
RUN apt-get update && apt-get install -y --no-install-recommends ca-certificates && rm -rf /var/lib/apt/lists/*
COPY --from=build /src/target/release/idemproxy /usr/local/bin/idemproxy
COPY config /etc/idemproxy
WORKDIR /var/lib/idemproxy
EXPOSE 8080
ENTRYPOINT ["idemproxy"]
CMD ["serve", "--config", "/etc/idemproxy/idemproxy.toml"]
