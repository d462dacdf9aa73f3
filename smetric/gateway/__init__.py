"""``smetric pick``: the routing core as the endpoint picker of an Envoy-based gateway.

The Gateway API Inference Extension's endpoint-picker protocol: the gateway's Envoy streams
each request to the picker over ``ext_proc`` (``protocol``: the messages), the picker
chooses an engine on the same view, policies and load accounting as ``smetric serve``
(``picker``), and Envoy sends the request there itself (``extproc``: one stream per
request). ``server`` runs it as a gRPC service with its health services and metrics.
"""
