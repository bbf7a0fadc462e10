"""``python -m fuzz``: see ``python -m fuzz --help`` and docs/fuzzing.md."""

import sys

from ._cli import main

sys.exit(main())
