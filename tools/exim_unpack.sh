#!/bin/sh
# Debian's Exim (exim4-daemon-light) unpacked into a directory of its own, for the tests that use Exim as a
# peer (tests/relay/test_exim_bdat.py). Installed with apt, Exim would replace Postfix, which other tests
# use: so its packages are downloaded (`apt-get download`) and unpacked with `dpkg -x`, never installed.
# The library exim4 links that the base system lacks (libidn12) is in SYSTEM_PACKAGES. Exim refuses to
# run without its compiled-in user, so the system user the package's own postinst makes (Debian-exim)
# is made if missing.
#
#   tools/exim_unpack.sh [DIR]     (default: var/exim; `make sysdeps` runs it)
#
# Idempotent: nothing is fetched again once DIR/usr/sbin/exim4 runs.
set -eu
dir=${1:-var/exim}
run() { "$dir/usr/sbin/exim4" "$@"; }
if ! id Debian-exim >/dev/null 2>&1; then
	useradd --system --user-group --no-create-home --home-dir /var/spool/exim4 --shell /usr/sbin/nologin Debian-exim
fi
if [ -x "$dir/usr/sbin/exim4" ] && run -bV -C /dev/null >/dev/null 2>&1; then
	exit 0
fi
mkdir -p "$dir/debs"
(cd "$dir/debs" && apt-get download -q exim4-daemon-light exim4-base exim4-config 2>&1 \
	| grep -v "unsandboxed as root" || true)
for deb in "$dir"/debs/*.deb; do dpkg -x "$deb" "$dir"; done
run -bV -C /dev/null 2>/dev/null | head -1
