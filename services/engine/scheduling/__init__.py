"""What runs when: sequences, sampling parameters, intent classes and the batch scheduler."""
