"""Across regions: the SyncActor, the protocol policy it follows, the outer step, codecs and Hivemind."""
