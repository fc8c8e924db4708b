#!/usr/bin/env bash
# Build the mllmd Debian package from this checkout (its working tree, committed or not):
#
#     packaging/build-deb.sh [--install-build-deps] [--lintian] [OUTDIR]
#
# The source tree is assembled in a temporary folder (the repository plus packaging/debian as
# debian/) and built with `dpkg-buildpackage -us -uc -b`; mllmd_<version>_<arch>.deb and its
# .buildinfo/.changes land in OUTDIR (default: dist/). Nothing is written into the checkout.
#   --install-build-deps   apt-get build-dep the missing build dependencies first (root)
#   --lintian              run lintian on the result (its tags are printed; errors fail)
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
install_deps=0
run_lintian=0
out=
for arg in "$@"; do
    case "$arg" in
        --install-build-deps) install_deps=1 ;;
        --lintian) run_lintian=1 ;;
        -h|--help) sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        -*) echo "build-deb.sh: unknown option $arg" >&2; exit 2 ;;
        *) out=$arg ;;
    esac
done
out=${out:-$repo/dist}
mkdir -p "$out"
out=$(cd "$out" && pwd)

version=$(dpkg-parsechangelog -l "$repo/packaging/debian/changelog" -S Version)
upstream=$(sed -n 's/^__version__ = "\(.*\)"$/\1/p' "$repo/mllmd/__init__.py")
if [ "${version%%[-+~]*}" != "$upstream" ]; then
    echo "build-deb.sh: packaging/debian/changelog is at $version but mllmd is $upstream;" \
         "add a changelog entry (dch -v $upstream)" >&2
    exit 1
fi

work=$(mktemp -d "${TMPDIR:-/tmp}/mllmd-deb.XXXXXX")
trap 'rm -rf "$work"' EXIT
src=$work/mllmd-$version
mkdir -p "$src"

# Tracked and untracked-but-not-ignored files (no .venv, caches or build output); a plain copy
# minus the usual litter where this is not a git checkout.
if git -C "$repo" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    (cd "$repo" && git ls-files -z --cached --others --exclude-standard \
        | while IFS= read -r -d '' f; do
              if [ -e "$f" ] || [ -L "$f" ]; then printf '%s\0' "$f"; fi
          done \
        | tar --null -T - -cf -) | tar -C "$src" -xf -
else
    tar -C "$repo" --exclude=.git --exclude=.venv --exclude=.ci-nvcc --exclude=.ci-triton30 --exclude=dist --exclude='*.egg-info' \
        --exclude=__pycache__ --exclude=.pytest_cache --exclude=.ruff_cache --exclude=.hypothesis \
        -cf - . | tar -C "$src" -xf -
fi
rm -rf "$src/debian"
cp -a "$repo/packaging/debian" "$src/debian"

if [ "$install_deps" = 1 ]; then
    DEBIAN_FRONTEND=noninteractive apt-get build-dep -y --no-install-recommends "$src"
fi

echo "build-deb.sh: building mllmd $version in $src" >&2
(cd "$src" && dpkg-buildpackage -us -uc -b)

arch=$(dpkg-architecture -qDEB_HOST_ARCH)
deb=mllmd_${version}_${arch}.deb
for f in "$work"/mllmd_"${version}"_*; do
    mv -f "$f" "$out/"
done
echo "build-deb.sh: $out/$deb ($(du -h "$out/$deb" | cut -f1))" >&2

if [ "$run_lintian" = 1 ]; then
    # Errors fail the build; warnings and the rest are printed.
    lintian --fail-on error --display-info "$out/$deb"
fi
