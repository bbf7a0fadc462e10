"""``python -m fuzz``: see ``python -m fuzz --help`` and docs/fuzzing.md."""

import gc
import sys

from ._cli import main

# What is loaded by now (hypothesis, numpy, trio, the product) lives as long as the
# process: move it out of the cyclic collector's generations, whose full passes would
# walk it again and again (an eighth of the runtime suite's time; half with it out).
# Here, not in main(), which a test may call inside its own process.
gc.collect()
gc.freeze()
sys.exit(main())
