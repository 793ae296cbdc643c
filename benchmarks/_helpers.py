"""The tests' input makers and bit-exact conversions (`tests/helpers.py`), loaded by path: a `tests`
package that some wheel installs in site-packages would otherwise shadow this repository's `tests/`."""

import importlib.util
import os

_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "helpers.py")
_spec = importlib.util.spec_from_file_location("xkern_tests_helpers", _PATH)
_helpers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_helpers)

TORCH_DTYPES = _helpers.TORCH_DTYPES
rand = _helpers.rand
same_bits = _helpers.same_bits
to_numpy = _helpers.to_numpy
to_torch = _helpers.to_torch
