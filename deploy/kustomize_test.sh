#!/usr/bin/env bash
# Renders every overlay under deploy/k8s/overlays with `kubectl kustomize`
# and checks the result offline with deploy/validate.js (schemas, unknown
# fields, ports, volumes, Secrets, jobs against cohortd); see
# deploy/k8s/README.md, "What the test checks". No cluster is used.
# KUBECTL picks the kubectl (default: the one on PATH); COHORT_TOOLS the
# folder tools/setup.sh installs the npm packages into.
set -uo pipefail

KUBECTL=${KUBECTL:-kubectl}
TOOLS=${COHORT_TOOLS:-/usr/local/lib/cohort-tools}
TMP=${TEST_TMPDIR:-$(mktemp -d)}
export HOME=${HOME:-$TMP}

# Missing tools fail the test: CI installs them with tools/setup.sh.
command -v "$KUBECTL" >/dev/null ||
  { echo "FAIL: no $KUBECTL on PATH ($PATH): run tools/setup.sh"; exit 1; }
command -v node >/dev/null || { echo "FAIL: no node on PATH: run tools/setup.sh"; exit 1; }
for p in kubernetes-models yaml; do
  [[ -f "$TOOLS/node_modules/$p/package.json" ]] ||
    { echo "FAIL: no npm package $p in $TOOLS/node_modules: run tools/setup.sh"; exit 1; }
done

# The source tree, for the BUILD files the Dockerfile's binaries come from.
workspace=$(cd "$(dirname "$(readlink -f deploy/Dockerfile)")/.." && pwd)
echo "kubectl: $("$KUBECTL" version --client 2>/dev/null | head -1)"

# kustomize does not follow the runfiles' symlinks: render a real copy.
rm -rf "$TMP/k8s" && cp -rL deploy/k8s "$TMP/k8s" || exit 1

renders=()
failed=0
for dir in "$TMP"/k8s/overlays/*/; do
  name=$(basename "$dir")
  if ! "$KUBECTL" kustomize "$dir" >"$TMP/$name.yaml" 2>"$TMP/$name.err"; then
    echo "FAIL: kubectl kustomize deploy/k8s/overlays/$name:"
    cat "$TMP/$name.err"
    failed=1
    continue
  fi
  renders+=("$name=$TMP/$name.yaml")
done
((${#renders[@]} > 0)) || { echo "FAIL: no overlay rendered"; exit 1; }
node deploy/validate.js --tools "$TOOLS" --workspace "$workspace" "${renders[@]}" || failed=1
exit $failed
