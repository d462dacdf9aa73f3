"""Recording the traffic a front door routes, as a trace a later study can load.

A package of its own because two front doors share it (``smetric serve`` and the
gateway's endpoint picker) and it depends on neither: it sits below them and above
``smetric.trace``, whose recording format (``trace.recording_format``) it writes and whose
loader reads it back.
"""
