"""Pattern calibration: how much the layers' top-k selections overlap, and which layers to keep as producers.

The IndexCache paper picks the producer (F) / shared (S) pattern greedily: start with every sparse layer a producer,
then repeatedly turn into a shared layer the producer whose loss costs least, until the producer budget is met. This
package measures the cross-layer overlap of top-k indices from a dump, runs that search under an overlap proxy or a
user objective (calibration LM loss from an engine), compares it with the ``index_topk_freq`` rule, and writes the
pattern, an ``index_topk_pattern`` config snippet, a JSON report and two plots (:func:`calibrate_dump` does all of it
for a dump directory). It only analyses dumps: :func:`indexcache.tools.model.record_dump` records one from a prefill
of the small random-weight model.

- :mod:`~indexcache.tools.calibrate.dump` — the dump format and :func:`load_dump`;
- :mod:`~indexcache.tools.calibrate.indices` — index arrays as ``[rows, k]``;
- :mod:`~indexcache.tools.calibrate.overlap` — the ``[L, L]`` overlap matrix;
- :mod:`~indexcache.tools.calibrate.pattern` — F/S patterns and the producer budget;
- :mod:`~indexcache.tools.calibrate.objective` — the search objective: the overlap proxy, a cache per pattern;
- :mod:`~indexcache.tools.calibrate.search` — the greedy search;
- :mod:`~indexcache.tools.calibrate.freq_rule` — the ``index_topk_freq`` baselines;
- :mod:`~indexcache.tools.calibrate.outputs`, :mod:`~indexcache.tools.calibrate.plots` — the files written;
- :mod:`~indexcache.tools.calibrate.calibration` — all of it: :func:`calibrate_arrays`, :func:`calibrate_dump`;
- :mod:`~indexcache.tools.calibrate.errors` — what each raises.
"""

from indexcache.tools.calibrate.calibration import Calibration, calibrate_arrays, calibrate_dump
from indexcache.tools.calibrate.dump import load_dump
from indexcache.tools.calibrate.errors import CalibrationError, DumpError, OutputError
from indexcache.tools.calibrate.plots import check_plotting
from indexcache.tools.calibrate.search import greedy_search

__all__ = ["Calibration", "CalibrationError", "DumpError", "OutputError", "calibrate_arrays", "calibrate_dump",
           "check_plotting", "greedy_search", "load_dump"]
