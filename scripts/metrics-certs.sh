#!/usr/bin/env bash
# Certificates for the metrics endpoint's TLS with client certificates (docs/deploy.md), made
# with openssl alone:
#   ca.crt, ca.key          a CA of nptrace's own: it signs the two below and nothing else (the
#                           cluster's CA would let every kubelet and user certificate scrape)
#   tls.crt, tls.key        the certificate every node's nptrace presents, for the DNS name
#                           nptrace-metrics (Prometheus checks it with tls_config.server_name,
#                           so one certificate serves every node's address)
#   client.crt, client.key  the certificate Prometheus presents
#
#   scripts/metrics-certs.sh DIR
#   kubectl -n nptrace create secret generic nptrace-metrics-tls \
#       --from-file=tls.crt=DIR/tls.crt --from-file=tls.key=DIR/tls.key --from-file=ca.crt=DIR/ca.crt
#   kubectl -n monitoring create secret generic nptrace-scrape-tls \
#       --from-file=ca.crt=DIR/ca.crt --from-file=client.crt=DIR/client.crt --from-file=client.key=DIR/client.key
#
# Keep ca.key off the cluster (it mints scrape credentials). NPTRACE_CERT_DAYS (default 365)
# sets the validity; NPTRACE_METRICS_NAME (default nptrace-metrics) the server's DNS name.
# tests/unit/test_metrics_tls.py runs this script and serves with what it makes.
set -euo pipefail
dir=${1:?usage: metrics-certs.sh DIR}
days=${NPTRACE_CERT_DAYS:-365}
name=${NPTRACE_METRICS_NAME:-nptrace-metrics}
umask 077
mkdir -p "$dir"
cd "$dir"

key() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1" 2>/dev/null; }

key ca.key
openssl req -x509 -new -key ca.key -out ca.crt -days "$days" -subj "/CN=nptrace metrics CA" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign"

# issue NAME CN EXTENSIONS: NAME.key and NAME.crt, signed by the CA
issue() {
    key "$1.key"
    openssl req -new -key "$1.key" -subj "/CN=$2" -out "$1.csr"
    printf 'basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature\n%s\n' "$3" > "$1.ext"
    openssl x509 -req -in "$1.csr" -CA ca.crt -CAkey ca.key -set_serial "0x$(openssl rand -hex 16)" \
        -days "$days" -extfile "$1.ext" -out "$1.crt" 2>/dev/null
    rm -f "$1.csr" "$1.ext"
}
issue tls "$name" "extendedKeyUsage=serverAuth
subjectAltName=DNS:$name"
issue client prometheus "extendedKeyUsage=clientAuth"
echo "metrics-certs: $dir: ca.crt tls.crt tls.key (nptrace, DNS:$name) client.crt client.key (Prometheus)" >&2
