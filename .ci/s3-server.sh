#!/usr/bin/env bash
# Installs the S3-compatible server the G4 (object storage) tests start:
# versitygw serving a local directory. Idempotent; the binary lands in
# $(go env GOPATH)/bin, where internal/s3test and the pytest fixture look.
set -euo pipefail
VERSITYGW_VERSION=v1.8.0
bin="$(go env GOPATH)/bin/versitygw"
if [ -x "$bin" ] && "$bin" --version 2>/dev/null | grep -q .; then
  echo "versitygw present: $bin"
  exit 0
fi
go install "github.com/versity/versitygw/cmd/versitygw@${VERSITYGW_VERSION}"
echo "versitygw installed: $bin"
