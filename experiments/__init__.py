"""The binaries: ``python -m experiments.train`` works as ``python experiments/train.py`` does.

Each binary imports its siblings (``lm``, ``train``, ``_figures``) as top-level
modules, which a script run by path finds next to itself. Run as a module of
this package, the same directory goes on ``sys.path`` here, before the binary
starts.
"""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
