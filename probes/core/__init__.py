"""What resolve and observe share: patching, targets, the recorder, lifecycles, the image inventory."""
