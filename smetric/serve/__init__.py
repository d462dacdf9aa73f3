"""The live router: ``smetric serve`` in front of real (or mock) OpenAI-compatible engines."""
