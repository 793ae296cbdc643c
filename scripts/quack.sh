# Sourced by setup.sh on a GPU machine: quack 0.6.5 (a benchmark peer, CuTe DSL) from the wheels in
# .whl_quack/, installed once per machine into /tmp/xkern-site. Where a copy of the tree is limited to 64 MiB
# the wheels come in two copies (docs/gpu-runs.md): .whl_quack/1 holds the first part of the libs-cu13 wheel,
# kept in /tmp/q until .whl_quack/2 brings the rest and the other wheels. Without them quack's rows read
# skipped; a failing install says so and changes nothing else. A later copy without .whl_quack/ still finds
# the installed quack (setup.sh sources this file on every GPU run).
QUACK_CU13=nvidia_cutlass_dsl_libs_cu13-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl
QUACK_SHA=50191a381d8cc1393373ae0bc879b0aefa9a256c23c22d4fa1c2fe3dfe57bc90
if [ -f .whl_quack/1/cu13.part.aa ]; then
  mkdir -p /tmp/q && cp .whl_quack/1/cu13.part.aa /tmp/q/
fi
if [ ! -f /tmp/xkern-site/.quack ] && [ -f .whl_quack/2/cu13.part.ab ] && [ -f /tmp/q/cu13.part.aa ]; then
  if cat /tmp/q/cu13.part.aa .whl_quack/2/cu13.part.ab > "/tmp/q/$QUACK_CU13" \
      && echo "$QUACK_SHA  /tmp/q/$QUACK_CU13" | sha256sum -c --quiet \
      && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/xkern-site \
           .whl_quack/2/*.whl "/tmp/q/$QUACK_CU13"; then
    touch /tmp/xkern-site/.quack
  else
    echo "quack: the install from .whl_quack/ failed; its rows will read skipped" >&2
  fi
fi
if [ -f /tmp/xkern-site/.quack ]; then
  export PYTHONPATH=/tmp/xkern-site/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}
fi
