#!/bin/sh
# mkman.sh: write the tdpipe(1) man page from the built binary's own help.
#
#   tools/mkman.sh TDPIPE VERSION DOCDIR OUT [DOC.md]...
#
# One source: the page is `tdpipe --help` (DESCRIPTION), `tdpipe help --list`
# (the commands) and `tdpipe CMD --help` for each (COMMANDS), turned into
# roff. Nothing here repeats their wording; it relies only on their shape:
#   - the first line is "usage: ..." (SYNOPSIS);
#   - an indented line whose first field is followed by two or more spaces
#     (or that starts with '-') is a term and its description ("  -p, --port
#     PORT   port ..."); lines indented further continue the description;
#   - other indented lines are shown as they are (sample output);
#   - lines at column 0 are running text; blank lines end paragraphs;
#   - the paragraph of the main help that starts "Exit status:" becomes
#     EXIT STATUS.
# DOCDIR and the DOC.md names go into SEE ALSO.
set -eu

if [ $# -lt 4 ]; then
    echo "usage: $0 TDPIPE VERSION DOCDIR OUT [DOC.md]..." >&2
    exit 2
fi
tdpipe=$1
version=$2
docdir=$3
out=$4
shift 4

# A sanitizer build's binary must not fail the build over its exit-time checks.
ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=0}
export ASAN_OPTIONS

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

"$tdpipe" --help >"$tmp/main"
"$tdpipe" help --list >"$tmp/list"

# help2roff MODE < help > roff. MODE "main": the top-level help (its usage
# line and exit-status paragraph are placed elsewhere); "sub": a command's.
help2roff() {
    awk -v mode="$1" -v main_exit="$main_exit" '
    function esc(s) {
        gsub(/\\/, "\\e", s)
        gsub(/-/, "\\-", s)
        if (s ~ /^[.\047]/)
            s = "\\&" s
        return s
    }
    function endpara() {
        if (pre) { print ".fi"; print ".RE"; pre = 0 }
        item = 0
    }
    function indent(s) { match(s, /^ */); return RLENGTH }
    # A command whose exit codes are the common ones (EXIT STATUS) does not
    # repeat them; one with its own keeps its paragraph.
    function flush_exit(   k, nl, ls) {
        if (!inexit) return
        inexit = 0
        if (ex != main_exit) {
            endpara(); print ".PP"
            nl = split(exlines, ls, "\n")
            for (k = 1; k < nl; k++) print esc(ls[k])
        }
        ex = ""; exlines = ""
    }
    NR == 1 && /^usage:/ {
        if (mode == "sub") { sub(/^usage: */, ""); print ".PP"; print ".B " esc($0) }
        next
    }
    /^[ \t]*$/ { flush_exit(); endpara(); newpara = 1; skip = 0; next }
    skip { next }
    /^Exit status:/ && mode == "main" { skip = 1; next }
    /^Exit status:/ && mode == "sub" { inexit = 1 }
    inexit { ex = ex (ex == "" ? "" : " ") $0; exlines = exlines $0 "\n"; next }
    /^[^ ]/ {
        if (pre || item) { endpara(); newpara = 1 }
        if (newpara) { print ".PP"; newpara = 0 }
        if ($0 ~ /^[A-Z][A-Za-z ]*:$/) print ".B " esc($0)
        else print esc($0)
        next
    }
    {
        n = indent($0)
        if (item && n >= item_indent + 5) {   # the description goes on
            line = $0; sub(/^ +/, "", line); print esc(line); next
        }
        body = substr($0, n + 1)
        gap = match(body, /[^ ]  +[^ ]/)
        # sample output goes on as it is until a blank line, unless an option follows
        if (pre && !(gap && body ~ /^-/))
            gap = 0
        if ((gap && !pre) || body ~ /^-/) {   # a term and its description
            if (pre) { print ".fi"; print ".RE"; pre = 0 }
            if (gap) {
                term = substr(body, 1, RSTART)
                desc = substr(body, RSTART + 1); sub(/^ +/, "", desc)
                desc_col = n + RSTART + RLENGTH - 1   # where the text starts, from 1
            } else if (desc_col > n + 2 && length($0) >= desc_col &&
                       substr($0, desc_col - 1, 1) == " " && substr($0, desc_col, 1) != " ") {
                # a term as long as the column: one space before the text
                term = substr($0, n + 1, desc_col - n - 2)
                desc = substr($0, desc_col)
            } else {
                term = body; desc = ""
            }
            print ".TP"
            print ".B " esc(term)
            if (desc != "") print esc(desc)
            item = 1; item_indent = n; newpara = 0
            next
        }
        if (!pre) {                            # shown as it is
            item = 0
            print ".RS 4"; print ".nf"; pre = 1; newpara = 0
        }
        print esc($0)
    }
    END { flush_exit(); endpara() }
    '
}

# One line of text, escaped for roff.
roff_text() {
    printf '%s\n' "$1" | sed 's/\\/\\e/g; s/-/\\-/g; s/^[.'"'"']/\\\&&/'
}

# The paragraph of the main help that starts "Exit status:".
exit_status() {
    awk '/^Exit status:/ { on = 1; sub(/^Exit status: */, "") }
         on && /^[ \t]*$/ { exit }
         on { gsub(/\\/, "\\e"); gsub(/-/, "\\-"); print }' "$tmp/main"
}

# The main help's exit-status paragraph, on one line.
main_exit=$(awk '/^Exit status:/ { on = 1 } on && /^[ \t]*$/ { exit }
                 on { printf "%s%s", (n++ ? " " : ""), $0 }' "$tmp/main")

# NAME's line: the first line of running text after the usage line.
summary=$(awk 'NR > 1 && /^[^ \t]/ { sub(/\.$/, ""); print tolower(substr($0, 1, 1)) substr($0, 2); exit }' "$tmp/main")

{
    echo '.\" Generated by tools/mkman.sh from the help of tdpipe '"$version"'; do not edit.'
    echo ".TH TDPIPE 1 \"\" \"tdpipe $version\" \"User Commands\""
    echo ".SH NAME"
    echo "tdpipe \\- $(roff_text "$summary")"
    echo ".SH SYNOPSIS"
    line=$(head -n 1 "$tmp/main")
    echo ".B $(roff_text "${line#usage: }")"
    while IFS="$(printf '\t')" read -r cmd _; do
        [ "$cmd" = help ] && continue
        u=$("$tdpipe" "$cmd" --help 2>/dev/null | head -n 1) || true
        case "$u" in usage:*) ;; *) continue ;; esac
        echo ".br"
        echo ".B $(roff_text "${u#usage: }")"
    done <"$tmp/list"
    echo ".SH DESCRIPTION"
    help2roff main <"$tmp/main"
    echo ".SH COMMANDS"
    while IFS="$(printf '\t')" read -r cmd what; do
        echo ".SS $cmd"
        # a command without a help of its own (help itself): its summary
        if "$tdpipe" "$cmd" --help >"$tmp/cmd" 2>/dev/null && head -n 1 "$tmp/cmd" | grep -q '^usage:'; then
            help2roff sub <"$tmp/cmd"
        else
            roff_text "$what"
        fi
    done <"$tmp/list"
    status=$(exit_status)
    if [ -n "$status" ]; then
        echo ".SH EXIT STATUS"
        printf '%s\n' "$status"
    fi
    d=$(printf '%s' "$docdir" | sed 's/-/\\-/g')
    echo ".SH FILES"
    echo ".TP"
    echo ".I $d/README.md"
    echo "what tdpipe is, how to build and use it"
    echo ".TP"
    echo ".I $d/docs/"
    echo "the guides, as Markdown (docs/README.md is the index)"
    echo ".TP"
    echo ".I $d/examples/"
    echo "example programs, C (built with the CMakeLists.txt there) and Python"
    echo ".SH SEE ALSO"
    echo "The guides in"
    echo ".IR $d/docs :"
    sep=""
    for doc in "$@"; do
        name=$(basename "$doc")
        [ -n "$sep" ] && echo "$sep"
        printf '.I %s' "$(printf '%s' "$name" | sed 's/-/\\-/g')"
        sep=","
    done
    [ -n "$sep" ] && echo ""
    echo ".PP"
    echo ".BR ucx_info (1),"
    echo ".BR ucx_perftest (1)"
} >"$tmp/page"

mv "$tmp/page" "$out"
