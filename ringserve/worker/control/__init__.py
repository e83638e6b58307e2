"""The worker's control loops: the coordinator client, view watch and heartbeats, exclusion, sightings, task ownership."""
