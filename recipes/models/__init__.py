"""LightningModules of the recipes: ResNet (images), BERT (text), GNN (graphs)."""

from recipes.models.bert import BertClassifier
from recipes.models.classifier import Classifier
from recipes.models.gnn import GNNClassifier
from recipes.models.resnet import ResNet, ResNetClassifier

__all__ = ["BertClassifier", "Classifier", "GNNClassifier", "ResNet", "ResNetClassifier"]
