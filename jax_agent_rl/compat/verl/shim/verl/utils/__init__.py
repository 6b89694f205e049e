"""The parts of ``verl.utils`` that tool and reward modules import."""
