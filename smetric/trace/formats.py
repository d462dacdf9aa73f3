"""The trace formats SMetric reads, by name, known without importing any loader (the
command line lists them in its help, which must start fast)."""

FORMATS = ("weka", "mooncake", "bailian", "azure", "parquet", "recording")
