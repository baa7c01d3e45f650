"""POSTs one charge three times with the same Idempotency-Key through HTTPS_PROXY: twice with
requests, once with httpx. Uses only the environment `idemproxy ca init` prints (HTTPS_PROXY,
REQUESTS_CA_BUNDLE, SSL_CERT_FILE). Prints one JSON object per call."""

import json
import sys

import httpx
import requests

url, key = sys.argv[1], sys.argv[2]
headers = {
    "Idempotency-Key": key,
    "Authorization": "Bearer sk_test_python",
    "Content-Type": "application/json",
}
body = json.dumps({"amount": 300, "currency": "eur"})


def report(client, status, replayed, content):
    print(json.dumps({"client": client, "status": status, "replayed": replayed,
                      "body": content.decode("utf-8", "replace")}), flush=True)


for _ in range(2):
    r = requests.post(url, headers=headers, data=body, timeout=30)
    report("requests", r.status_code, r.headers.get("Idempotent-Replayed"), r.content)

# httpx reads HTTPS_PROXY and SSL_CERT_FILE from the environment (trust_env=True).
with httpx.Client(timeout=30) as client:
    r = client.post(url, headers=headers, content=body)
    report("httpx", r.status_code, r.headers.get("Idempotent-Replayed"), r.content)
