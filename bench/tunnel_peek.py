"""What the CONNECT peek costs a blind tunnel: first-byte latency through the proxy, next to a
direct connection, for one or more idemproxy builds (run on demand: bench/peek.sh).

    python3 bench/tunnel_peek.py N BINARY [BINARY...]

For each build it starts the proxy on a config with one route (so the routed-address check
runs) and a loopback TLS server and a server that speaks first (an SMTP-like banner) as the
unrouted targets, then, N times each, sequentially, one connection at a time:

- tls: CONNECT, then the TLS handshake (the ClientHello the proxy peeks at), then one request;
  the time from the CONNECT's 200 to the handshake's end, and to the answer's first byte;
- banner: CONNECT to the server that speaks first, the time from the 200 to its first byte.

Prints a Markdown table of medians and 90th percentiles in milliseconds. Only loopback.
"""
import os
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tls_server(ctx, port):
    srv = socket.create_server(("127.0.0.1", port))

    def serve(conn):
        try:
            with ctx.wrap_socket(conn, server_side=True) as tls:
                tls.recv(4096)
                tls.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")
        except OSError:
            pass

    def loop():
        while True:
            conn, _ = srv.accept()
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=loop, daemon=True).start()


def banner_server(port):
    srv = socket.create_server(("127.0.0.1", port))

    def loop():
        while True:
            conn, _ = srv.accept()
            try:
                conn.sendall(b"220 bench ESMTP\r\n")
                conn.recv(64)
            except OSError:
                pass
            conn.close()

    threading.Thread(target=loop, daemon=True).start()


def connect_via(proxy, target):
    s = socket.create_connection(proxy)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    s.sendall(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = s.recv(1)
        if not chunk:
            raise RuntimeError(f"proxy closed: {head!r}")
        head += chunk
    if b" 200 " not in head.split(b"\r\n")[0]:
        raise RuntimeError(head.decode(errors="replace"))
    return s


def tls_round(client_ctx, sock):
    start = time.perf_counter()
    tls = client_ctx.wrap_socket(sock, server_hostname="localhost")
    shaken = time.perf_counter()
    tls.sendall(b"GET / HTTP/1.1\r\nHost: localhost\r\n\r\n")
    tls.recv(1)
    first = time.perf_counter()
    tls.close()
    return shaken - start, first - start


def banner_round(sock):
    start = time.perf_counter()
    sock.recv(1)
    got = time.perf_counter() - start
    sock.close()
    return got


def measure(n, client_ctx, open_tls, open_banner):
    hs, fb, bn = [], [], []
    for _ in range(n):
        h, f = tls_round(client_ctx, open_tls())
        hs.append(h)
        fb.append(f)
        bn.append(banner_round(open_banner()))
    return hs, fb, bn


def ms(values):
    values = sorted(values)
    p90 = values[int(len(values) * 0.9) - 1]
    return f"{statistics.median(values) * 1000:.3f} / {p90 * 1000:.3f}"


def start_proxy(binary, tmp, ports):
    listen = free_port()
    cfg = os.path.join(tmp, f"proxy-{listen}.toml")
    with open(cfg, "w") as f:
        f.write(
            f'[server]\nlisten = "127.0.0.1:{listen}"\n\n[store]\nurl = "sqlite://{tmp}/claims-{listen}.db"\n\n'
            f"[tls]\nconnect_ports = [443, {ports[0]}, {ports[1]}]\n\n"
            '[[routes]]\nname = "pay"\nupstream = "https://api.pay.test"\nconnect_to = "127.0.0.1:9"\n\n'
            '[egress]\nallow = ["127.0.0.1"]\n'
        )
    proc = subprocess.Popen(
        [binary, "serve", "--config", cfg],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "IDEMPROXY_LOG": "warn"},
    )
    for _ in range(200):
        try:
            socket.create_connection(("127.0.0.1", listen), timeout=0.1).close()
            return proc, ("127.0.0.1", listen)
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"{binary} did not start")


def main():
    n = int(sys.argv[1])
    binaries = sys.argv[2:]
    with tempfile.TemporaryDirectory() as tmp:
        key, cert = os.path.join(tmp, "key.pem"), os.path.join(tmp, "cert.pem")
        subprocess.run(
            ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
             "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost",
             "-keyout", key, "-out", cert],
            check=True, capture_output=True,
        )
        server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        server_ctx.load_cert_chain(cert, key)
        client_ctx = ssl.create_default_context(cafile=cert)
        tls_port, banner_port = free_port(), free_port()
        tls_server(server_ctx, tls_port)
        banner_server(banner_port)
        rows = []

        def direct(port):
            s = socket.create_connection(("127.0.0.1", port))
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return s

        rows.append(("direct (no proxy)",) + measure(n, client_ctx, lambda: direct(tls_port), lambda: direct(banner_port)))
        for binary in binaries:
            proc, proxy = start_proxy(binary, tmp, (tls_port, banner_port))
            try:
                measure(20, client_ctx, lambda: connect_via(proxy, f"127.0.0.1:{tls_port}"),
                        lambda: connect_via(proxy, f"127.0.0.1:{banner_port}"))  # warm-up
                rows.append((binary,) + measure(
                    n, client_ctx,
                    lambda: connect_via(proxy, f"127.0.0.1:{tls_port}"),
                    lambda: connect_via(proxy, f"127.0.0.1:{banner_port}"),
                ))
            finally:
                proc.kill()
                proc.wait()
    print(f"{n} sequential rounds each; median / p90, ms from the CONNECT's 200 (direct: from the TCP connect)\n")
    print("| build | TLS handshake | first answer byte | server-first banner |")
    print("|---|---:|---:|---:|")
    for name, hs, fb, bn in rows:
        print(f"| {name} | {ms(hs)} | {ms(fb)} | {ms(bn)} |")


if __name__ == "__main__":
    main()
