#!/usr/bin/env bash
# Builds the linearizability checker offline, from the Go module cache that
# tools/setup.sh fills (no network: GOPROXY=off).
#   build.sh OUT_BINARY      builds lincheck into OUT_BINARY
#   build.sh --test [ARG...] runs the module's unit tests: go test ARG... .
# It works from a Bazel runfiles tree, where the sources are symlinks: they
# are copied into a scratch folder first. Go's build cache is
# $TEST_TMPDIR/gocache inside a test, else $GOCACHE or Go's default.
# COHORT_GOMODCACHE overrides the module cache's place.
set -euo pipefail

usage="usage: build.sh OUT_BINARY | build.sh --test [GO_TEST_ARG...]"
(($# > 0)) || { echo "$usage" >&2; exit 2; }

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
gomod=${COHORT_GOMODCACHE:-/usr/local/lib/cohort-tools/gomod}
version=$(awk '$1 == "require" && $2 == "github.com/anishathalye/porcupine" { print $3 }' "$here/go.mod")
if [[ ! -f "$gomod/cache/download/github.com/anishathalye/porcupine/@v/$version.mod" ||
      ! -d "$gomod/github.com/anishathalye/porcupine@$version" ]]; then
  echo "build.sh: porcupine $version not in $gomod: run tools/setup.sh" >&2
  exit 1
fi
go=$(command -v go || echo /usr/local/go/bin/go)
[[ -x "$go" ]] || { echo "build.sh: no go command (PATH, /usr/local/go/bin): run tools/setup.sh" >&2; exit 1; }

scratch=$(mktemp -d "${TEST_TMPDIR:-${TMPDIR:-/tmp}}/lincheck-src.XXXXXX")
trap 'rm -rf "$scratch"' EXIT
cp -L "$here"/go.mod "$here"/go.sum "$here"/*.go "$scratch/"

cache=${TEST_TMPDIR:+$TEST_TMPDIR/gocache}
goenv=(env GOMODCACHE="$gomod" GOPROXY=off GOFLAGS=-mod=mod GOTOOLCHAIN=local GOWORK=off
       GOCACHE="${cache:-${GOCACHE:-}}")
if [[ $1 == --test ]]; then
  shift
  cd "$scratch" && "${goenv[@]}" "$go" test "$@" .
else
  out=$1
  [[ $out == /* ]] || out=$PWD/$out
  cd "$scratch" && "${goenv[@]}" "$go" build -o "$out" .
fi
