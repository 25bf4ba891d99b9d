"""Ready-made search strategies, built only on the public API.

Each function takes a :class:`~lloyal.Context` and a prompt (text, or token
ids), runs its search with :class:`~lloyal.Branch` and
:class:`~lloyal.BranchStore` (``best_of_n``, ``beam_search`` and ``mcts``
also take a :class:`lloyal.cluster.ContextPool`: each is written once,
against the backend in ``_lanes``), prunes every branch it made before returning
(also on error or cancellation), and returns a small frozen dataclass: the
chosen :class:`Continuation` (text, tokens, per-token surprisal and entropy)
plus the numbers a researcher asks for -- how many ``llama_decode`` calls
it took (from ``ctx.stats``), acceptance rates, scores, wall time.

* :func:`generate` -- one branch, produce/commit until a stop token; the
  baseline the others are measured against.
* :func:`best_of_n` -- N forks of one prefilled prompt, generated in
  lockstep (one decode per step for all N), the lowest perplexity wins.
* :func:`beam_search` -- width-W beam search on summed log-probabilities.
* :func:`speculative_decode` -- draft tokens cheaply (a smaller model with
  the same vocabulary, or :class:`PromptLookup`), verify them all in one
  target decode, keep the accepted prefix plus one token from the target.
* :func:`sample_tree` and :func:`mcts` -- token trees expanded one batched
  decode per level, and a small Monte Carlo tree search over them.

Surprisal and entropy are in nats, measured on the model's raw
distribution at the step where each token was chosen. ``decode_calls``
counts every decode on the context while the function ran (other work on
the same context at the same time is counted too).
"""

from __future__ import annotations

# The public names, and the type aliases their signatures use (`x as x`
# marks those as re-exported).
from lloyal.strategies._beam_search import BeamSearch, beam_search
from lloyal.strategies._best_of_n import BestOfN, best_of_n
from lloyal.strategies._common import Continuation
from lloyal.strategies._common import Progress as Progress
from lloyal.strategies._common import Prompt as Prompt
from lloyal.strategies._common import Score as Score
from lloyal.strategies._generate import Generated, generate
from lloyal.strategies._mcts import MCTS, mcts
from lloyal.strategies._speculative import PromptLookup, Speculative, speculative_decode
from lloyal.strategies._tree import SampledTree, TreeNode, sample_tree

__all__ = [
    "MCTS",
    "BeamSearch",
    "BestOfN",
    "Continuation",
    "Generated",
    "PromptLookup",
    "SampledTree",
    "Speculative",
    "TreeNode",
    "beam_search",
    "best_of_n",
    "generate",
    "mcts",
    "sample_tree",
    "speculative_decode",
]
