"""What the hardware does, shared by every driver: step times, KV tiers and links, presets,
and the hardware rates a cost-based policy prices with."""
