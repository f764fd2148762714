#!/usr/bin/env bash
# Regenerates the TLS fixtures of kube_client's tests: a test CA, an API-server certificate for
# 127.0.0.1 / kubernetes.default.svc signed by it, and an unrelated CA. Test-only keys.
set -euo pipefail
cd "$(dirname "$0")"
days=36500
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days $days \
    -subj "/CN=kvroute test cluster CA" -keyout ca.key -out ca.crt 2>/dev/null
openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes \
    -subj "/CN=kube-apiserver" -keyout server.key -out server.csr 2>/dev/null
printf 'subjectAltName=IP:127.0.0.1,DNS:kubernetes.default.svc\nbasicConstraints=CA:FALSE\nkeyUsage=digitalSignature\nextendedKeyUsage=serverAuth\n' > ext.cnf
openssl x509 -req -in server.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days $days \
    -extfile ext.cnf -out server.crt 2>/dev/null
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days $days \
    -subj "/CN=some other CA" -keyout other-ca.key -out other-ca.crt 2>/dev/null
rm -f server.csr ext.cnf ca.srl ca.key other-ca.key
