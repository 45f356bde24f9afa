"""What a run tells about itself: step records, metrics.jsonl, trackers, throughput, timing, profiles, stragglers."""
