#!/usr/bin/env bash
# Compiles android_demo/core (plain Java, no Android) and its JUnit 4 tests with javac, runs them with JUnit's console
# runner, exits non-zero on any failure. Needs a JDK (javac, java) and Debian's junit4 + hamcrest jars; no Gradle, no
# network. Output goes to android_demo/core/build/ (git-ignored).
#   android_demo/run_core_tests.sh            # all tests
#   android_demo/run_core_tests.sh ReportTest # only the named test classes (simple names)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
core="$here/core"
build="$core/build"
repo="$(cd "$here/.." && pwd)"
jars_dir="${JUNIT_JARS_DIR:-/usr/share/java}"

for tool in javac java; do
  if ! command -v "$tool" >/dev/null 2>&1; then
    echo "run_core_tests: '$tool' not found; install a JDK (Debian: apt-get install -y default-jdk-headless)" >&2
    exit 2
  fi
done
junit="$jars_dir/junit4.jar"
hamcrest=""
for h in hamcrest.jar hamcrest-core.jar hamcrest-all.jar; do
  if [ -f "$jars_dir/$h" ]; then hamcrest="$jars_dir/$h"; break; fi
done
if [ ! -f "$junit" ] || [ -z "$hamcrest" ]; then
  echo "run_core_tests: JUnit 4 jars not found in $jars_dir (need junit4.jar and hamcrest.jar); install them with: apt-get install -y junit4" >&2
  exit 2
fi
cp_test="$junit:$hamcrest"

rm -rf "$build"
mkdir -p "$build/classes" "$build/test-classes"

# --release 8: the core must stay within what Android's Java offers (it is dexed into the app).
find "$core/src/main/java" -name '*.java' > "$build/main-sources.txt"
javac --release 8 -Xlint:all,-options -Werror -encoding UTF-8 -d "$build/classes" @"$build/main-sources.txt"

find "$core/src/test/java" -name '*.java' > "$build/test-sources.txt"
javac --release 8 -Xlint:all,-options -encoding UTF-8 -cp "$build/classes:$cp_test" -d "$build/test-classes" \
  @"$build/test-sources.txt"

if [ "$#" -gt 0 ]; then
  classes=()
  for c in "$@"; do classes+=("org.edgekv.core.$c"); done
else
  mapfile -t classes < <(cd "$core/src/test/java" && find . -name '*Test.java' | sed 's|^\./||; s|\.java$||; s|/|.|g' | sort)
fi

# The tests find their fixtures and the shared report schema through these properties.
java -Dedgekv.test.resources="$core/src/test/resources" \
     -Dedgekv.report.schema="$repo/edgekv/profile/report.schema.json" \
     -Dedgekv.test.tmp="$build/tmp" \
     -cp "$build/classes:$build/test-classes:$cp_test" org.junit.runner.JUnitCore "${classes[@]}"
