"""The response headers the router adds, which clients (``smetric replay``) measure with.

Every leg of a request says which engine served it, and what the router expected that
engine to find cached, so a client can set the prediction beside the engine's own
``cached_tokens`` request by request.
"""

ENGINE_HEADER = "x-smetric-engine"
PREDICTED_HIT_HEADER = "x-smetric-predicted-hit-tokens"
# Disaggregated: the engines of the two legs, how long the prefill leg took as the router
# saw it, and the prompt tokens the prefill engine found cached.
PREFILL_HEADER = "x-smetric-prefill-engine"
PREFILL_SECONDS_HEADER = "x-smetric-prefill-seconds"
PREFILL_CACHED_HEADER = "x-smetric-prefill-cached-tokens"
DECODE_HEADER = "x-smetric-decode-engine"
