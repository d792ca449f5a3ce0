#!/usr/bin/env bash
# test_install.sh BUILD_DIR: `cmake --install` gives a user what
# `tdpipe --help` points to, and the installed tree works on its own.
#
#   - the installed tdpipe runs without a libtdpipe on LD_LIBRARY_PATH (its
#     RPATH finds libtdpipe in PREFIX/lib...): --help, version. The other
#     entries stay: a machine may keep the dependencies (libsodium, UCX...)
#     where only LD_LIBRARY_PATH finds them;
#   - its --help names the installed guides, which are there (README.md,
#     every docs/*.md, the examples with their CMakeLists.txt);
#   - the man page is installed and renders without warnings (man -l, else
#     groff; skipped, with a message, when neither is installed);
#   - README.md and docs/README.md list every docs/*.md;
#   - an example builds against the installed prefix through
#     find_package(tdpipe), and one through pkg-config, and both run.
#
# The prefix is a scratch directory, removed at the end. About 10 s.
set -euo pipefail

BUILD=${1:?usage: test_install.sh BUILD_DIR}
BUILD=$(cd "$BUILD" && pwd)
SRC=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
P=$TMP/p
fails=0

ok() { echo "ok:   $*"; }
fail() {
    echo "FAIL: $*"
    fails=$((fails + 1))
}
check() { # check WHAT COMMAND...: run it, ok or FAIL with its output
    local what=$1
    shift
    if out=$("$@" 2>&1); then
        ok "$what"
    else
        fail "$what"
        printf '%s\n' "$out" | sed 's/^/      /'
    fi
}

echo ">> cmake --install $BUILD --prefix $P"
cmake --install "$BUILD" --prefix "$P" >"$TMP/install.log" 2>&1 || {
    cat "$TMP/install.log"
    echo "FAIL: cmake --install"
    exit 1
}

# ---- the binary finds its library -------------------------------------------
# LD_LIBRARY_PATH without the directories that hold a libtdpipe
LDP=
IFS=: read -r -a ldirs <<<"${LD_LIBRARY_PATH:-}"
for d in "${ldirs[@]}"; do
    [[ -n $d ]] && ! compgen -G "$d/libtdpipe.so*" >/dev/null && LDP=${LDP:+$LDP:}$d
done
TDPIPE=$P/bin/tdpipe
if [[ ! -x "$TDPIPE" ]]; then
    echo "FAIL: $TDPIPE not installed (TDP_BUILD_TOOLS off?)"
    exit 1
fi
check "installed tdpipe --help runs with no libtdpipe on LD_LIBRARY_PATH" \
    env LD_LIBRARY_PATH="$LDP" "$TDPIPE" --help
check "installed tdpipe version runs with no libtdpipe on LD_LIBRARY_PATH" \
    env LD_LIBRARY_PATH="$LDP" "$TDPIPE" version
# (into a variable first: grep -q stopping early must not fail ldd's pipe)
deps=$(env LD_LIBRARY_PATH="$LDP" ldd "$TDPIPE" 2>&1 || true)
if grep -q "libtdpipe.*$P/" <<<"$deps"; then
    ok "libtdpipe resolves inside the prefix"
else
    fail "libtdpipe does not resolve inside the prefix:"
    grep tdpipe <<<"$deps" | sed 's/^/      /'
fi

# ---- the docs --help names ----------------------------------------------------
help=$(env LD_LIBRARY_PATH="$LDP" "$TDPIPE" --help)
docdir=$(cd "$P" && find . -path '*/doc/tdpipe' -type d | head -n 1)
docdir=$P/${docdir#./}
if [[ -d "$docdir" ]] && grep -qF "$(cd "$docdir" && pwd -P)" <<<"$help"; then
    ok "--help names the installed docs ($docdir)"
else
    fail "--help does not name the installed docs directory '$docdir'"
fi
for f in README.md examples/CMakeLists.txt examples/producer.c examples/python/dataloader.py; do
    [[ -f "$docdir/$f" ]] && ok "installed $f" || fail "not installed: $f"
done
for page in "$SRC"/docs/*.md; do
    name=docs/$(basename "$page")
    if cmp -s "$page" "$docdir/$name"; then
        ok "installed $name"
    else
        fail "not installed (or not the same): $name"
    fi
done

# both indexes list every page: the README's and docs/README.md
for page in "$SRC"/docs/*.md; do
    name=$(basename "$page")
    [[ $name == README.md ]] && continue
    grep -qF "](docs/$name)" "$SRC/README.md" || fail "README.md does not list docs/$name"
    grep -qF "]($name)" "$SRC/docs/README.md" || fail "docs/README.md does not list $name"
done

# ---- the man page ----------------------------------------------------------------
man1=$(find "$P" -path '*/man1/tdpipe.1' | head -n 1)
if [[ -z "$man1" ]]; then
    fail "man page tdpipe.1 not installed"
else
    ok "installed ${man1#"$P"/}"
    # every command the binary lists has a section in the page
    while IFS=$'\t' read -r cmd _; do
        grep -q "^\.SS $cmd\$" "$man1" || fail "man page has no section for '$cmd'"
    done < <(env LD_LIBRARY_PATH="$LDP" "$TDPIPE" help --list)
    if command -v man >/dev/null 2>&1 || command -v groff >/dev/null 2>&1; then
        # groff's warnings (-ww) are the lint: an unknown request or escape
        # shows there (man -l itself passes them over in silence)
        if command -v groff >/dev/null 2>&1; then
            groff -man -ww -z "$man1" 2>"$TMP/man.err" || echo "groff exited $?" >>"$TMP/man.err"
        fi
        if command -v man >/dev/null 2>&1; then
            rendered=$(MANWIDTH=80 man -l "$man1" 2>>"$TMP/man.err") || true
        else
            rendered=$(groff -man -Tutf8 -P-cbou "$man1" 2>>"$TMP/man.err") || true
        fi
        if [[ -s "$TMP/man.err" ]]; then
            fail "man page renders with warnings:"
            sed 's/^/      /' "$TMP/man.err"
        elif ! grep -q "^NAME" <<<"$rendered" || ! grep -q "tdpipe send HOST:PORT" <<<"$rendered" ||
            ! grep -q "^EXIT STATUS" <<<"$rendered"; then
            fail "man page renders without NAME, the send synopsis or EXIT STATUS"
        else
            ok "man page renders ($(wc -l <<<"$rendered") lines), no warnings"
        fi
    else
        echo "skip: man page rendering: neither man nor groff is installed (man-db / groff-base)"
    fi
fi

# ---- an example against the installed prefix --------------------------------------
# find_package(tdpipe), with the examples' own CMakeLists.txt, as they say
echo ">> examples against $P (find_package)"
gen=()
command -v ninja >/dev/null 2>&1 && gen=(-G Ninja)
if cmake "${gen[@]}" -S "$docdir/examples" -B "$TMP/ex" -DCMAKE_PREFIX_PATH="$P" \
    -DCMAKE_BUILD_TYPE=Release >"$TMP/ex.log" 2>&1 &&
    cmake --build "$TMP/ex" --target schema_demo >>"$TMP/ex.log" 2>&1; then
    check "examples/schema_demo built with find_package(tdpipe) runs" \
        env LD_LIBRARY_PATH="$(dirname "$(find "$P" -name 'libtdpipe.so' | head -n 1)")" \
        "$TMP/ex/schema_demo"
else
    fail "examples do not configure or build against $P:"
    tail -n 30 "$TMP/ex.log" | sed 's/^/      /'
fi
# pkg-config, as the README's one-liner
pc=$(find "$P" -name tdpipe.pc | head -n 1)
if [[ -n "$pc" ]] && command -v pkg-config >/dev/null 2>&1; then
    flags=$(PKG_CONFIG_PATH=$(dirname "$pc") pkg-config --cflags --libs tdpipe)
    # shellcheck disable=SC2086 # flags are meant to split
    if cc "$docdir/examples/schema_demo.c" -o "$TMP/schema_demo_pc" $flags 2>"$TMP/pc.log"; then
        check "examples/schema_demo.c built with pkg-config runs" \
            env LD_LIBRARY_PATH="$(dirname "$(find "$P" -name 'libtdpipe.so' | head -n 1)")" \
            "$TMP/schema_demo_pc"
    else
        fail "cc with pkg-config --cflags --libs tdpipe:"
        sed 's/^/      /' "$TMP/pc.log"
    fi
else
    fail "tdpipe.pc not installed, or no pkg-config"
fi

if ((fails > 0)); then
    echo "test_install: $fails failure(s)"
    exit 1
fi
echo "test_install: all passed"
